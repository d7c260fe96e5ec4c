"""A Hugging Face tokenizer directory as a tokenizer (`--tokenizer hf:DIR`, formats/tokenizer_json.py):
the converted tiktoken encoder against the `tokenizers` library, the document markers, prepare,
save/load, the export, and each refusal. No released Llama/Qwen tokenizer is reachable offline:
the directories are trained here with `tokenizers` in each family's style."""

import json
import pickle
import unicodedata

import pytest
import tiktoken
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from formats import tokenizer, tokenizer_json
from formats.errors import UserError
from tests.test_data import DOCS, run_prepare, write_corpus
from train.data import shards

# Qwen2/Qwen3's split regex (tokenizer.json's pre_tokenizer Split pattern).
QWEN_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
            r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = DOCS + ["Stay, illusion! If thou hast any sound or use of voice, speak to me. " * 20,
                "Naïve café owners über-think 1234567 numbers; résumé, coöperate.\n" * 10]
# Text whose NFC form differs (a decomposed é, an angstrom sign): Qwen normalizes before splitting.
UNNORMALIZED = "Cafe\u0301 and \u212b: de\u0301ja\u0300 vu"


def hf_tokenizer_dir(out, style, vocab_size=700):
    """A tokenizer directory as transformers saves one: Qwen-style (NFC, no BOS, <|endoftext|>
    ends documents, ChatML template) or Llama-3-style (BOS and EOS, ignore_merges)."""
    tok = Tokenizer(models.BPE(ignore_merges=style == "llama"))
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PAT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=vocab_size,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if style == "qwen":
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        config = {"bos_token": None, "eos_token": "<|endoftext|>", "chat_template": CHATML}
    else:
        tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
        config = {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|end_of_text|>"}
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def reference_ids(hf_dir, text):
    """`tokenizers`' ids with special-token text read as plain text, as every path here reads it."""
    reference = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    reference.encode_special_tokens = True
    return reference.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("style", ["qwen", "llama"])
def test_the_converted_tokenizer_encodes_as_the_tokenizers_library(tmp_path, style):
    hf_dir = hf_tokenizer_dir(tmp_path / style, style)
    enc = tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{hf_dir}"))
    for text in TEXTS + tokenizer_json.PROBES + [UNNORMALIZED]:
        assert enc.encode_ordinary(text) == reference_ids(hf_dir, text), text
        assert enc.decode(enc.encode_ordinary(text)) == (unicodedata.normalize("NFC", text) if style == "qwen" else text)
    assert enc.encode_ordinary_batch(TEXTS) == [reference_ids(hf_dir, t) for t in TEXTS]
    plain = tiktoken.Encoding(name="plain", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                              special_tokens=enc._special_tokens)
    # The normalization is what makes Qwen's ids: without it the decomposed text tokenizes otherwise.
    assert (plain.encode_ordinary(UNNORMALIZED) != enc.encode_ordinary(UNNORMALIZED)) == (style == "qwen")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return hf_tokenizer_dir(tmp_path_factory.mktemp("hf") / "qwen", "qwen")


def test_document_markers_follow_the_tokenizer_config(tmp_path, qwen_dir):
    qwen = tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{qwen_dir}"))
    eot = qwen._special_tokens["<|endoftext|>"]
    # No BOS (Qwen): <|endoftext|> alone separates documents, so it starts each and ends the one before.
    assert tokenizer.special_ids(qwen) == {"bos": eot, "eos": None, "stop": [eot],
                                           "model_vocab_size": -(-qwen.n_vocab // 128) * 128}
    llama = tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{hf_tokenizer_dir(tmp_path / 'llama', 'llama')}"))
    specials = llama._special_tokens
    assert (tokenizer.bos_id(llama), tokenizer.end_id(llama)) == (specials["<|begin_of_text|>"], specials["<|end_of_text|>"])


def test_prepare_with_an_hf_tokenizer_stores_its_ids_and_keeps_it_with_the_data(tmp_path, qwen_dir):
    out = tmp_path / "data"
    docs = DOCS + [UNNORMALIZED]
    assert run_prepare("--input", write_corpus(tmp_path / "src", "text", docs), "--out", out,
                       "--tokenizer", f"hf:{qwen_dir}", "--val-fraction", 0) == 0
    with shards.open_dataset(out, "train") as ds:
        stored = sorted(ds.doc(i).tolist() for i in range(len(ds)))
    assert stored == sorted(reference_ids(qwen_dir, d) for d in docs)
    again = tokenizer.load_tokenizer(out)           # the data's copy: a converted tokenizer as before
    assert isinstance(again, tokenizer_json.HFEncoding) and again.extras() == {
        "normalization": "NFC", "document_start": "<|endoftext|>", "document_end": "<|endoftext|>"}
    assert again.encode_ordinary(UNNORMALIZED) == reference_ids(qwen_dir, UNNORMALIZED)
    revived = pickle.loads(pickle.dumps(again))     # what a spawned prepare worker receives
    assert revived.extras() == again.extras() and revived.encode_ordinary(UNNORMALIZED) == again.encode_ordinary(UNNORMALIZED)
    # The same ranks without the normalization are another tokenizer.
    plain = tiktoken.Encoding(name="plain", pat_str=again._pat_str, mergeable_ranks=again._mergeable_ranks,
                              special_tokens=again._special_tokens)
    with pytest.raises(UserError, match="their Unicode normalization differ"):
        tokenizer.check_same_tokenizer(again, plain, "model", "data")
    # The Hugging Face directory given as a plain DIR is told apart from our tokenizer files.
    with pytest.raises(UserError, match=f"is a Hugging Face tokenizer.json.*pass --tokenizer hf:{qwen_dir}"):
        tokenizer.build_tokenizer(tokenizer.parse_spec(str(qwen_dir)))


def test_the_export_writes_the_normalizer_so_auto_tokenizer_encodes_alike(tmp_path, qwen_dir):
    from transformers import AutoTokenizer

    from formats.hf_export import write_tokenizer
    from torch_model.config import ModelConfig

    enc = tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{qwen_dir}"))
    eot = enc._special_tokens["<|endoftext|>"]
    cfg = ModelConfig(vocab_size=768, bos_token_id=eot, eos_token_id=eot)
    assert write_tokenizer(enc, tmp_path, cfg).startswith("transformers:")
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS + [UNNORMALIZED]:
        assert auto.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all"), text


def _edit(hf_dir, out, edit_json=None, config=None):
    out.mkdir()
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    if edit_json:
        edit_json(data)
    (out / "tokenizer.json").write_text(json.dumps(data))
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return out


def _swap_two_merges(data):
    merges = data["model"]["merges"]
    merges[10], merges[11] = merges[11], merges[10]


@pytest.mark.parametrize("edit_json, config, message", [
    (lambda d: d.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁"}), None,
     "field 'pre_tokenizer' is \\['Metaspace'\\], expected a byte-level BPE's"),
    (lambda d: d.update(normalizer={"type": "Lowercase"}), None, "field 'normalizer' is 'Lowercase'"),
    (lambda d: d["model"].update(byte_fallback=True), None, "field 'model.byte_fallback' is True"),
    (lambda d: d["model"].update(type="Unigram"), None, "field 'model.type' is 'Unigram', expected a byte-level 'BPE'"),
    (_swap_two_merges, None, "merge 11 .* merge order is not id order"),
    (None, {"bos_token": "<s>"}, "field 'bos_token' is '<s>', not one of the added tokens"),
    (None, {"eos_token": None}, "field 'eos_token' is missing"),
])
def test_a_tokenizer_json_tiktoken_cannot_express_is_refused_naming_the_field(tmp_path, qwen_dir, edit_json, config,
                                                                              message):
    bad = _edit(qwen_dir, tmp_path / "bad", edit_json, config)
    with pytest.raises(UserError, match=message):
        tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{bad}"))


def test_an_hf_spec_names_a_missing_directory_or_file(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        tokenizer.parse_spec(f"hf:{tmp_path / 'nowhere'}")
    with pytest.raises(UserError, match="no tokenizer.json"):
        tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{tmp_path}"))
