"""Models: Llama-family decoder, MTP head, loaders."""
from jmtp.model.config import ModelConfig, RopeScaling
from jmtp.model.forward import forward_hidden, forward_logits
from jmtp.model.llama import KVCache, compute_logits, forward, init_kv_cache, mtp_forward
from jmtp.model.metadata import AttentionMetadata, ragged_batch
from jmtp.model.modules import DraftHead, LlamaForCausalLM, MTPHead
from jmtp.model.checkpoints.loader import load_checkpoint, load_model, load_tokenizer
from jmtp.model.checkpoints.mtp_head import load_mtp_head, load_mtp_head_module
from jmtp.model.params import check_params, init_mtp_params, init_params

__all__ = [
    "ModelConfig", "RopeScaling", "forward_hidden", "forward_logits", "KVCache", "compute_logits",
    "forward", "init_kv_cache", "mtp_forward", "AttentionMetadata", "ragged_batch", "check_params",
    "init_mtp_params", "init_params", "LlamaForCausalLM", "MTPHead", "DraftHead",
    "load_checkpoint", "load_model", "load_tokenizer", "load_mtp_head", "load_mtp_head_module",
]
