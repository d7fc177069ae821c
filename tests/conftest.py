"""Shared test set-up: 8 fake CPU devices, before anything imports jax; epath on gcsfs."""

import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# etils.epath picks tf.io.gfile for gs:// when TensorFlow is importable, and
# caches that choice at the first gs:// path of the process.  The object-storage
# tests point gcsfs at a local server; tf.io.gfile cannot be pointed anywhere
# but Google's servers.  Decide before anything touches a gs:// path.
os.environ.setdefault('EPATH_USE_TF', 'false')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
