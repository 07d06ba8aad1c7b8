"""Tokenizer (HF `tokenizers`), chat template (jinja2 sandbox) and a streaming detokenizer.

Sources: a HF folder's tokenizer.json + tokenizer_config.json, or GGUF metadata — gpt2-style BPE
(tokens + merges + the pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`) or a llama
SentencePiece vocab (tokens + scores, byte fallback).
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat_template import render_template
from .errors import ModelFormatError, TokenizerError

# llama.cpp pre-tokenizer names → the split regex it applies before byte-level BPE.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Words split by case, as tokenizer.json writes them (llama.cpp spells the same classes with lookaheads): Mistral
# Nemo's / Small 3's tekken splits digits one by one, GPT-4o's o200k (Phi-4-mini, Llama 4) keeps up to 3 and
# lets a word take a contraction.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN_PATTERN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_PATTERN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
                 rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}|\p{{N}}{{1,3}}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    bos_id: int | None = None
    eos_ids: set[int] = field(default_factory=set)
    add_bos: bool = False
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    meta: dict[str, str] = field(default_factory=dict)  # GGUF tokenizer model and pre-tokenizer names
    source: str = ""  # the file the chat template came from, named in its errors
    id_count: int | None = None  # a GGUF vocabulary's ids are its list's positions: 0 .. id_count - 1

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template: use --raw to send the text as is")
        return render_template(self.chat_template, self.source, messages=messages,
                               add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                               eos_token=self.eos_token)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes BOS itself where the model wants one, as HF's apply_chat_template does.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_bos=False)

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)


# ------------------------------------------------------------------------------------------------
# Streaming: emit text as tokens arrive, never half a UTF-8 character; the pieces concatenate to
# decode(all tokens). Decoding a short window [prefix, n) keeps each step O(window), not O(n).
# ------------------------------------------------------------------------------------------------
class StreamDecoder:
    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: decoding starts here so context-dependent spacing is kept
        self.read = 0  # tokens before this have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        if not final and (full.endswith("\ufffd") or len(full) <= len(done)):
            return ""  # an incomplete multi-byte character: wait for the next token
        delta = full[len(done):]
        self.prefix, self.read = self.read, len(self.ids)
        return delta


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------
def load_tokenizer(source: Any) -> Tokenizer:
    """`source`: a HF folder path, or a GGUFSource (edgellm.loading)."""
    if isinstance(source, (str, Path)):
        return tokenizer_from_folder(Path(source))
    return tokenizer_from_gguf(source)


def tokenizer_from_folder(folder: Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelFormatError(f"{folder}: no tokenizer.json (only fast-tokenizer folders are supported)")
    try:
        backend = Backend.from_file(str(path))
    except Exception as e:
        raise ModelFormatError(f"{path}: cannot read tokenizer ({str(e).splitlines()[0]})") from e
    cfg = _json(folder / "tokenizer_config.json")
    gen = _json(folder / "generation_config.json")
    model_cfg = _json(folder / "config.json")
    _check_settings(folder, cfg, gen, model_cfg)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if (folder / "chat_template.jinja").is_file():
        try:
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"{folder / 'chat_template.jinja'}: cannot read ({e})") from e
    bos_token = _token_text(cfg.get("bos_token"))
    eos_token = _token_text(cfg.get("eos_token"))
    bos_id = backend.token_to_id(bos_token) if bos_token else model_cfg.get("bos_token_id")
    eos_ids = set()
    for value in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
        eos_ids |= set(value if isinstance(value, list) else [value] if value is not None else [])
    if eos_token and backend.token_to_id(eos_token) is not None:
        eos_ids.add(backend.token_to_id(eos_token))
    # The post-processor (if any) is where HF adds BOS; we add it ourselves to keep one code path.
    add_bos = bool(cfg.get("add_bos_token", _post_processor_adds_bos(backend, bos_id)))
    backend.post_processor = None
    tok = Tokenizer(backend, bos_id, eos_ids, add_bos, template, bos_token or "", eos_token or "",
                    meta=_gguf_names(backend), source=str(folder))
    _add_end_of_turn_tokens(tok)
    return tok


def _check_settings(folder: Path, cfg: Any, gen: Any, model_cfg: Any) -> None:
    """The tokenizer settings we read, of the types HF writes: a wrong type is named here, with its file,
    instead of failing inside the tokenizers library or jinja."""
    files = {"tokenizer_config.json": cfg, "generation_config.json": gen, "config.json": model_cfg}
    for name, d in files.items():
        if not isinstance(d, dict):
            raise ModelFormatError(f"{folder / name}: not a JSON object")

    def bad(file: str, key: str, want: str) -> ModelFormatError:
        return ModelFormatError(f"{folder / file}: {key} should be {want}, found {str(files[file][key])[:60]!r}")

    template = cfg.get("chat_template")
    if template is not None and not isinstance(template, str):
        if (not isinstance(template, list) or not template
                or not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template)):
            raise bad("tokenizer_config.json", "chat_template", "a string or a list of {name, template}")
    for key in ("bos_token", "eos_token"):
        v = cfg.get(key)
        if v is not None and not isinstance(v, str) and not (isinstance(v, dict) and isinstance(v.get("content"), str)):
            raise bad("tokenizer_config.json", key, "a string or {content: string}")
    if cfg.get("add_bos_token") is not None and not isinstance(cfg["add_bos_token"], bool):
        raise bad("tokenizer_config.json", "add_bos_token", "true or false")
    for file, key in (("generation_config.json", "eos_token_id"), ("config.json", "eos_token_id"),
                      ("config.json", "bos_token_id")):
        v = files[file].get(key)
        ids = v if isinstance(v, list) and key == "eos_token_id" else [v]
        if v is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise bad(file, key, "a token id" + (" or a list of them" if key == "eos_token_id" else ""))


def _gguf_names(backend: Any) -> dict[str, str]:
    """The names llama.cpp would give this tokenizer (for GGUF export)."""
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return {"model": "unsupported"}
    if model.get("byte_fallback"):
        return {"model": "llama", "pre": "default"}
    pre = json.dumps(spec.get("pre_tokenizer"))
    if '"individual_digits": true' in pre:
        name = "smollm"
    elif "\\p{N}{1,3}" in pre:
        name = "llama-bpe"
    elif "\\p{N}|" in pre:
        name = "qwen2"
    else:
        name = "default"
    return {"model": "gpt2", "pre": name}


def _post_processor_adds_bos(backend: Any, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    return backend.encode("a").ids[:1] == [bos_id]


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _add_end_of_turn_tokens(tok: Tokenizer) -> None:
    """Chat models end a turn with a token that is not always the declared EOS."""
    for text in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<end_of_turn>"):
        i = tok.backend.token_to_id(text)
        if i is not None and (text != "<|endoftext|>" or not tok.eos_ids):
            tok.eos_ids.add(i)


def tokenizer_from_gguf(src: Any) -> Tokenizer:
    field = src.field
    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError(f"{src.path}: GGUF has no tokenizer (tokenizer.ggml.tokens)")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind not in ("gpt2", "llama"):
        raise ModelFormatError(f"{src.path}: tokenizer model {kind!r} is not supported (gpt2, llama)")
    try:  # the tokenizers library refuses a malformed vocabulary or merge list with its own errors
        if kind == "gpt2":
            backend = _gguf_bpe(tokens, field("tokenizer.ggml.merges") or [], field("tokenizer.ggml.pre") or "default")
        else:
            backend = _gguf_spm(tokens, field("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                bool(field("tokenizer.ggml.add_space_prefix", True)))
    except Exception as e:
        raise ModelFormatError(f"{src.path}: the tokenizer in the GGUF metadata is malformed "
                               f"({str(e).strip().splitlines()[0][:160]})") from e
    from tokenizers import AddedToken

    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types) if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    backend.add_special_tokens(specials)
    bos_id = field("tokenizer.ggml.bos_token_id")
    eos_id = field("tokenizer.ggml.eos_token_id")
    eos_ids = {eos_id} if eos_id is not None else set()
    eot = field("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(eot)
    add_bos = field("tokenizer.ggml.add_bos_token")
    tok = Tokenizer(backend, bos_id, eos_ids, bool(kind == "llama" if add_bos is None else add_bos),
                    field("tokenizer.chat_template"),
                    tokens[bos_id] if bos_id is not None else "", tokens[eos_id] if eos_id is not None else "",
                    meta={"model": kind, "pre": field("tokenizer.ggml.pre") or "default"}, source=str(src.path),
                    id_count=len(tokens))
    _add_end_of_turn_tokens(tok)
    return tok


def _gguf_bpe(tokens: list[str], merges: list[str], pre: str) -> Any:
    from tokenizers import Regex, Tokenizer as Backend, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # Llama 3's vocabulary (tiktoken's) holds words its merges cannot reach: a pre-token that is a token is that
    # token, as llama.cpp (ignore_merges for these names) and HF's tokenizer.json ("ignore_merges": true) do
    whole_words = pre in ("llama3", "llama-bpe", "llama-v3", "tekken")
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=whole_words))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe"):
        split = [pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"), byte_level]
    elif pre == "tekken":
        split = [pre_tokenizers.Split(Regex(TEKKEN_PATTERN), behavior="isolated"), byte_level]
    elif pre in ("gpt-4o", "llama4"):
        split = [pre_tokenizers.Split(Regex(GPT4O_PATTERN), behavior="isolated"), byte_level]
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        split = [pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"), byte_level]
    elif pre in ("smollm", "starcoder", "refact", "codeshell"):  # digits one by one, then gpt2
        split = [pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        if pre not in ("default", "gpt2", "gpt-2"):
            warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known; using GPT-2's split")
        split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(split)
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_spm(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool) -> Any:
    """A llama SentencePiece (BPE-type) vocab as a `tokenizers` BPE: merges are ranked by the score
    of the merged piece, which is how sentencepiece picks the next merge."""
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers

    from .spm_merges import spm_merges

    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((t for t, ty in zip(tokens, types) if ty == 2), None)
    backend = Backend(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, vocab), unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(dec)
    return backend
