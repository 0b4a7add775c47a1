"""jmtp's ground floor: the vocabulary every layer shares, importing nothing else of jmtp.

* :mod:`jmtp.core.mesh`: mesh and logical axis names, the one logical → mesh axis table, and the
  helpers that read the mesh a step is traced under (``mesh_context``, ``model_axis_size``,
  ``auto_axes``, ``uniform_any``);
* :mod:`jmtp.core.checks`: argument checks with one message format;
* :mod:`jmtp.core.multihost`: host values into and out of a mesh that spans several processes
  (``put``, ``fetch``, ``SyncFirstCall``) and the coordination-service exchanges behind them
  (``barrier``, ``allgather_host``): the device runner places and reads arrays with it, the host
  loop exchanges its plans with it.

Kernels (:mod:`jmtp.pallas`), the model (:mod:`jmtp.model`), the engine and the entry points import
from here; nothing here imports them.
"""
