"""TEMPORARY allocator used until jmtp.pallas.block_allocator lands (same contract)."""
import dataclasses
import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AllocResult:
    free_stack: jax.Array
    free_count: jax.Array
    block_tables: jax.Array
    num_owned: jax.Array
    paused: jax.Array


def allocate_blocks(free_stack, free_count, block_tables, num_owned, release, num_needed,
                    implementation=None):
    B, P = block_tables.shape

    def rel(carry, b):
        fs, fc, bt, no = carry
        row = bt[b]
        n = jnp.where(release[b], no[b], 0)
        idx = jnp.where(jnp.arange(P) < n, fc + jnp.arange(P), fs.shape[0])
        fs = fs.at[idx].set(row, mode="drop")
        fc = fc + n
        bt = bt.at[b].set(jnp.where(release[b], -1, row))
        no = no.at[b].set(jnp.where(release[b], 0, no[b]))
        return (fs, fc, bt, no), None

    (fs, fc, bt, no), _ = jax.lax.scan(rel, (free_stack, free_count, block_tables, num_owned),
                                       jnp.arange(B))

    def alloc(carry, b):
        fs, fc, bt, no = carry
        need = jnp.maximum(num_needed[b] - no[b], 0)
        ok = (need <= fc) & (num_needed[b] <= P)
        take = jnp.where(ok, need, 0)
        j = jnp.arange(P)
        src = fc - 1 - (j - no[b])
        new = (j >= no[b]) & (j < no[b] + take)
        bt = bt.at[b].set(jnp.where(new, fs[jnp.clip(src, 0, fs.shape[0] - 1)], bt[b]))
        no = no.at[b].add(take)
        fc = fc - take
        return (fs, fc, bt, no), (need > 0) & ~ok

    (fs, fc, bt, no), paused = jax.lax.scan(alloc, (fs, fc, bt, no), jnp.arange(B))
    return AllocResult(fs, fc, bt, no, paused)
