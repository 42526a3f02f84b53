"""Suite-wide settings that must be in place before any test module imports torch or triton."""

import os
import shutil

# Triton decides at import time whether kernels are compiled or interpreted, and the plugin
# manager imports the triton backend as soon as any test builds an engine. Without a GPU the
# kernels can only run interpreted, so say so before anything imports triton; the tests of the
# "no GPU, no interpreter" path unset it themselves.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# sleeping, not spinning, OpenMP threads (pagoda sets this too, but only if it is imported first)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
