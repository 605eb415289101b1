"""oomb: exact long-context training of Hugging Face decoder models on one GPU.

    import oomb
    loss = oomb.chunked_backward(model, input_ids)   # grads accumulate in .grad

Importing oomb registers the "oomb" attention implementation with transformers.
"""

from oomb.engine import chunked_backward, release_memory

__version__ = "0.2.0"
__all__ = ["__version__", "chunked_backward", "release_memory"]
