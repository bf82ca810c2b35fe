"""Hugging Face ``transformers`` integration (the optional ``[hf]`` extra, transformers 5).

Importing this package registers the model type ``"fastweights"`` with ``AutoConfig`` and
``AutoModelForCausalLM``, so a folder written by ``FastWeightsForCausalLM.save_pretrained`` (or
by ``native_to_hf``) loads with ``AutoModelForCausalLM.from_pretrained(folder)``.

- ``FastWeightsConfig`` (``config.py``): a ``PreTrainedConfig`` with exactly the fields of
  ``LMConfig`` (generated from them, plus the usual ``use_cache`` and special token ids),
  validated by building the ``LMConfig``.
- ``FastWeightsForCausalLM`` (``model.py``): ``PreTrainedModel`` + ``GenerationMixin`` around
  the native ``LanguageModel`` (held as ``self.model``, so every weight name is the native one
  prefixed by ``"model."``); ``forward`` returns ``CausalLMOutputWithPast`` with the loss when
  ``labels`` are given and a ``FastWeightsCache`` when ``use_cache``. Its forward reads in four
  steps, one module each: input checks (``inputs.py``), packed documents and right padding
  (``packing.py``), row groups (``cache.py``: left-padded rows start from their first token)
  and the run loop (``model.py``).
- ``FastWeightsCache`` (``cache.py``): the cache object (``cache``; ``past_key_values`` before
  transformers 5.24). It holds each layer's state exactly as the layer returns it (fast-weight
  matrices for recurrent mixers, the KV cache for softmax), so ``generate()`` feeds one new
  token per step, and the memory held per sequence is constant for recurrent mixers.
- ``native_to_hf`` / ``hf_to_native`` (``convert.py``): lossless conversion between the two
  checkpoint folders.

- ``use_fastweights(model)`` (``kernels.py``): transformers' own gated-delta models (Qwen3.5,
  Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid, LaraMini, Qwen4-Exp: ``gated_delta_architectures()``)
  with their gated-delta layers on fastweights' ops (CPU prefill and decoding, with or without
  fla installed).

fla's models behind the same API are ``fastweights.fla``'s (``fastweights.fla.hf``).
"""

try:
    import transformers  # noqa: F401
except ImportError as err:  # the core library works without the extra; this package does not
    raise ImportError(
        "fastweights.hf needs transformers 5: pip install 'fastweights[hf]' "
        "(or pip install 'transformers>=5,<6')") from err

from transformers import AutoConfig, AutoModelForCausalLM

from .cache import FastWeightsCache
from .config import FastWeightsConfig
from .convert import PREFIX, hf_to_native, native_to_hf
from .kernels import gated_delta_architectures, use_fastweights
from .model import CACHE_FIELD, FastWeightsForCausalLM

__all__ = [
    "CACHE_FIELD",
    "PREFIX",
    "FastWeightsCache",
    "FastWeightsConfig",
    "FastWeightsForCausalLM",
    "gated_delta_architectures",
    "hf_to_native",
    "native_to_hf",
    "use_fastweights",
]

AutoConfig.register(FastWeightsConfig.model_type, FastWeightsConfig, exist_ok=True)
AutoModelForCausalLM.register(FastWeightsConfig, FastWeightsForCausalLM, exist_ok=True)
