"""A Hugging Face tokenizer directory as a tokenizer (`--tokenizer hf:DIR`, formats/tokenizer_json.py):
the converted tiktoken encoder against the `tokenizers` library, the document markers, prepare,
save/load, the export, and each refusal. No released Llama/Qwen tokenizer is reachable offline:
the directories are trained here with `tokenizers` in each family's style."""

import json
import pickle
import unicodedata

import numpy as np
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
        "normalization": "NFC", "document_start": "<|endoftext|>", "document_end": "<|endoftext|>",
        "chat_template": CHATML}
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


def test_the_export_writes_the_normalizer_and_template_so_auto_tokenizer_encodes_alike(tmp_path, qwen_dir):
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
    assert auto.apply_chat_template(CHATS[0], tokenize=False) == AutoTokenizer.from_pretrained(str(qwen_dir)).apply_chat_template(
        CHATS[0], tokenize=False)


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


# ---- SFT with the tokenizer's own chat template ------------------------------------------------
CHATS = [[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who wrote Hamlet?"},
          {"role": "assistant", "content": "Shakespeare."}, {"role": "user", "content": "When?"},
          {"role": "assistant", "content": "Around 1600, in London.\nIt was printed in 1603."}],
         [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi! Café time? 1234"}]]
# Llama-3-style, with transformers' {% generation %} marks: they say which characters are trained.
MARKED = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot_id|>{% endgeneration %}"
          "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}")


def messages(chat):
    return [{**m, "thinking": None} for m in chat]


def test_a_conversation_renders_as_apply_chat_template_with_weight_on_the_assistants_text_only(qwen_dir):
    from transformers import AutoTokenizer

    from train.data import conversations

    enc = tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{qwen_dir}"))
    auto = AutoTokenizer.from_pretrained(str(qwen_dir))
    for chat in CHATS:
        ids, weights = conversations.render_weighted(enc, messages(chat))
        assert enc.decode(ids.tolist()) == auto.apply_chat_template(chat, tokenize=False)
        assert ids.tolist() == auto.apply_chat_template(chat, tokenize=True, return_dict=False)
        trained = enc.decode(ids[weights == 1].tolist())
        assert trained == "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")
        assert np.count_nonzero(np.diff(weights.astype(int)) == 1) == sum(m["role"] == "assistant" for m in chat)


def test_generation_marks_decide_the_trained_text_and_the_templates_bos_is_left_to_the_packer(tmp_path):
    from train.data import conversations

    hf_dir = hf_tokenizer_dir(tmp_path / "llama", "llama")
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": MARKED}))
    data["added_tokens"] += [{"id": 702 + k, "content": t, "special": True, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False}
                             for k, t in enumerate(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])]
    (hf_dir / "tokenizer.json").write_text(json.dumps(data))
    enc = tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{hf_dir}"))
    ids, weights = conversations.render_weighted(enc, messages(CHATS[0]))
    assert ids[0] != tokenizer.bos_id(enc), "the packer puts the document start before every conversation"
    assert enc.decode(ids[weights == 1].tolist()) == "Shakespeare.<|eot_id|>Around 1600, in London.\nIt was printed in 1603.<|eot_id|>"
    assert enc.decode(ids.tolist()).startswith("<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>")


def test_a_template_that_rewrites_earlier_turns_or_thinking_or_no_template_is_refused(tmp_path, qwen_dir):
    from train.data import conversations

    rewrites = _edit(qwen_dir, tmp_path / "rewrites", config={"chat_template": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.last %}{{ m['content'] }}{% else %}..."
        "{% endif %}<|im_end|>\n{% endfor %}")})
    enc = tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{rewrites}"))
    with pytest.raises(UserError, match="renders the turns before assistant message 2 differently"):
        conversations.render_weighted(enc, messages(CHATS[0]))
    qwen = tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{qwen_dir}"))
    thinking = [*messages(CHATS[1])[:1], {"role": "assistant", "content": "Hi", "thinking": "greet"}]
    with pytest.raises(UserError, match="an assistant message has 'thinking'"):
        conversations.render_weighted(qwen, thinking)
    bare = _edit(qwen_dir, tmp_path / "bare", config={"chat_template": None})
    with pytest.raises(UserError, match="has no chat template"):
        conversations.check_chat_tokenizer(tokenizer.build_tokenizer(tokenizer.parse_spec(f"hf:{bare}")), "x")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, qwen_dir):
    """Conversations rendered with the directory's chat template: train and val split."""
    from train.cli import main

    tmp_path = tmp_path_factory.mktemp("chats")
    # The validation split is its own file: --val-fraction hashes each document's id, which holds the
    # temporary path, so the split (and whether val has a batch of short conversations) varied by run.
    chats, val = tmp_path / "chats.jsonl", tmp_path / "val.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 16))
    val.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 4))
    data = tmp_path / "chat_data"
    assert main(["prepare", "--chat", "--input", str(chats), "--val-input", str(val), "--out", str(data),
                 "--tokenizer", f"hf:{qwen_dir}"]) == 0
    return data


def test_template_rendered_chats_weight_only_the_assistants_tokens(chat_data):
    enc = tokenizer.load_tokenizer(chat_data)
    with shards.open_dataset(chat_data, "train") as ds:
        docs = [ds.doc(d) for d in range(len(ds))]
        weights = ds.read_segments([(d, 0, int(ds.lengths[d])) for d in range(len(ds))], "weights")
    answers = {"".join(m["content"] + "<|im_end|>\n" for m in c if m["role"] == "assistant") for c in CHATS}
    assert docs and all(enc.decode(ids[w == 1].tolist()) in answers for ids, w in zip(docs, weights))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_sft_of_each_transformers_family_trains_only_the_assistants_tokens(chat_data, family, tmp_path):
    """`train --model-config` on the template-rendered chats: every step's loss counts the
    assistant's tokens only (a share of the row's tokens, never all, never none)."""
    from tests.transformers_configs import CONFIGS
    from train.cli import main

    config = {**CONFIGS[family]().to_dict(), "vocab_size": tokenizer.load_tokenizer(chat_data).n_vocab,
              "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "sft"
    assert main(["train", "--model-config", str(tmp_path / "config.json"), "--data", str(chat_data), "--out", str(out),
                 "--steps", "2", "--batch-size", "2", "--seq-len", "64", "--log-every", "1", "--eval-every", "2",
                 "--eval-batches", "1", "--samples", "0"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2 and all(0 < r["trained_tokens"] and 0 < r["trained_share"] < 1 for r in train)


def test_preference_pairs_render_with_the_template_training_each_answer_not_the_prompts_reply(tmp_path, qwen_dir):
    from train.data import preferences

    prompt = CHATS[0][:4]                   # ends with the user's "When?", an assistant reply inside it
    pair = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Around 1600."}],
            "rejected": [{"role": "assistant", "content": "In 1066, in Paris."}]}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    out = tmp_path / "pairs"
    assert run_prepare("--preferences", "--input", tmp_path / "pairs.jsonl", "--out", out,
                       "--tokenizer", f"hf:{qwen_dir}", "--val-fraction", 0) == 0
    enc = tokenizer.load_tokenizer(out)
    with shards.open_dataset(out, "train") as ds:
        ids = ds.doc(0)
        codes = ds.read_segments([(0, 0, int(ds.lengths[0]))], "weights")[0]
    side, trained = preferences.side_of(codes), preferences.trained(codes)
    for s, key in ((0, "chosen"), (1, "rejected")):
        assert enc.decode(ids[(side == s) & (trained == 1)].tolist()) == pair[key][0]["content"] + "<|im_end|>\n"
        assert enc.decode(ids[side == s].tolist()) == enc.decode(conversations_ids(enc, prompt + pair[key]))


def conversations_ids(enc, chat):
    from train.data import conversations

    return conversations.render_weighted(enc, messages(chat))[0].tolist()
