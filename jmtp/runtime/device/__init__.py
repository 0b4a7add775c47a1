"""Traced code and the only holder of device arrays: the step, its stages and proposers, state and
slot operations, device sampling, sharding and the :class:`~jmtp.runtime.device.runner.DeviceRunner`
that jits them. Imports nothing from ``runtime.host`` or ``runtime.serve``
(``tests/test_layering.py``)."""
