"""jmtp's ground floor: the vocabulary every layer shares, importing nothing else of jmtp.

* :mod:`jmtp.core.mesh`: mesh and logical axis names, the one logical → mesh axis table, and the
  helpers that read the mesh a step is traced under (``mesh_context``, ``model_axis_size``,
  ``auto_axes``, ``uniform_any``);
* :mod:`jmtp.core.checks`: argument checks with one message format.

Kernels (:mod:`jmtp.pallas`), the model (:mod:`jmtp.model`), the engine and the entry points import
from here; nothing here imports them.
"""
