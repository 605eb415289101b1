"""oomb: exact long-context training of Hugging Face decoder models on one GPU.

    import oomb
    loss = oomb.chunked_backward(model, input_ids)   # grads accumulate in .grad

Importing oomb registers the "oomb" attention implementation with transformers.
"""

import sys
from pathlib import Path

try:
    from oomb.engine import chunked_backward, release_memory
except KeyboardInterrupt:
    # Ctrl-C in the first seconds of the `oomb` command, while torch and transformers load: nothing has been
    # read or written yet, so a line instead of a traceback (docs/failures.md). A library import re-raises.
    if Path(sys.argv[0]).name != "oomb":
        raise
    sys.stderr.write("stopped: interrupted while starting, before anything was read or written\n")
    raise SystemExit(130) from None

__version__ = "0.2.0"
__all__ = ["__version__", "chunked_backward", "release_memory"]
