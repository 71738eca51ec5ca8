"""The model's own tokenizer and chat template, from a GGUF file or an HF directory.

transformers can build a fast tokenizer from a GGUF's embedded vocabulary, but that takes seconds
(it parses the whole file and converts the BPE merges), so the built tokenizer is saved once under
`~/.cache/tessera/tokenizers/<key>` (key: the file's path, size, mtime and the transformers
version) and later loads read that directory instead. Set TESSERA_CACHE_DIR to move the cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tessera.chat_templates import FALLBACK_CHAT_TEMPLATES

logger = logging.getLogger(__name__)


def cache_root() -> str:
    """$TESSERA_CACHE_DIR, else $XDG_CACHE_HOME/tessera, else ~/.cache/tessera."""
    if os.environ.get("TESSERA_CACHE_DIR"):
        return os.environ["TESSERA_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tessera")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str, architecture: str | None = None) -> PreTrainedTokenizerFast | None:
    """The fast tokenizer (with chat template) of a `.gguf` file or an HF directory; None for an
    HF directory that ships no tokenizer at all (such a model takes token-id prompts only).
    Without a template in the file, the `architecture`'s known one serves (chat_templates.py)."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path) and path.endswith(".gguf"):
        tokenizer = _load_gguf_tokenizer(path)
    elif os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            logger.warning("%s has no tokenizer: only token-id prompts, no output text", path)
            return None
        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        raise ValueError(f"no tokenizer at {path!r}: expected a .gguf file or an HF directory")
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{path}: no fast tokenizer (tokenizer.json) found")
    if tokenizer.chat_template is None and architecture in FALLBACK_CHAT_TEMPLATES:
        logger.info("%s has no chat template: using %s's", path, architecture)
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATES[architecture]
    if tokenizer.chat_template is None:
        logger.warning("%s: the model has no chat template; chat requests will be refused", path)
    return tokenizer


def _gguf_cache_dir(path: str) -> str:
    st = os.stat(path)
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|transformers={transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(cache_root(), "tokenizers", f"{name}-{digest}")


def _load_gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    cache_dir = _gguf_cache_dir(path)
    if os.path.isdir(cache_dir):
        return AutoTokenizer.from_pretrained(cache_dir)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    logger.info("built tokenizer from %s in %.1f s", path, time.perf_counter() - start)
    try:
        # Save to a scratch dir and rename: a reader never sees a half-written cache entry.
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        scratch = tempfile.mkdtemp(dir=os.path.dirname(cache_dir), prefix=".tmp-")
        tokenizer.save_pretrained(scratch)
        try:
            os.rename(scratch, cache_dir)
        except OSError:  # another process got there first
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the tokenizer under %s: %s", cache_dir, e)
    return tokenizer


def apply_chat_template(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict], *, tools: list[dict] | None = None,
    chat_template: str | None = None, add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template (or `chat_template`),
    ending with the assistant's generation prompt unless told otherwise; or, with
    `continue_final_message`, ending inside the last (assistant) message so the model continues
    it. ValueError if there is no chat template."""
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use a completion prompt instead")
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, tokenize=True, return_dict=False,
    )
    if not isinstance(ids, list):  # a BatchEncoding, in some transformers versions
        ids = ids["input_ids"]
    return [int(i) for i in ids]

