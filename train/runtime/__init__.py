"""Where a process computes: the device, the precision on it, and the process group.

resolve.py (`resolve_runtime`: train.device and train.precision resolved once, into a `Runtime`),
device.py (the device and CUDA's environment), precision.py (what each precision means for DeepSpeed
and the build), process_group.py (the launcher's process group, or a one-process one).
"""
