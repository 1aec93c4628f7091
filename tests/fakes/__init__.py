"""Stand-ins for what cannot run on a machine without an NVIDIA GPU (test fixtures only):
`cupti/cupti.py` for cupti-python's `cupti.cupti`, `controller.py` for the agent's CUPTI
controller, `libcupti.c` for the parts of libcupti the agent calls through ctypes."""
