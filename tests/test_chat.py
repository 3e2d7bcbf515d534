"""--chat: the model's template rendered as transformers' apply_chat_template renders it, the
turn's end as the stop token, and one error line when the template is missing or fails."""
import json

import pytest

from gguf_files import CHAT, write_gguf
from helpers import decode_main, run_cli
from nanospec.io import chat
from nanospec.io.convert import convert
from nanospec.io.tokenizer import load_tokenizer

SMOLLM_LIKE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
               "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
               "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    return convert(write_gguf(d / "tiny.gguf"), d / "hf")


@pytest.mark.parametrize("tmpl", [CHAT, SMOLLM_LIKE, "{{ bos_token }}{{ messages[0]['content'] | tojson }}"
                                  "{% if add_generation_prompt %}>{% endif %}"])
def test_render_equals_transformers(tiny, tmp_path, tmpl):
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "d"
    d.mkdir()
    for f in tiny.iterdir():
        (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text(tmpl)  # takes precedence over tokenizer_config.json's
    ref = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "user", "content": "Write a \"prime\" test.\n  é 日本 <|im_end|>"}]
    text = chat.render(messages[0]["content"], chat.template(d), load_tokenizer(d).config)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids, stop = chat.prompt_ids(d, load_tokenizer(d), messages[0]["content"])
    assert ids == list(ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"])
    assert stop == 2  # <|im_end|>


def test_decode_chat_stops_at_end_of_turn(tiny, capsys):
    assert decode_main(["--weights", str(tiny), "--chat", "--prompt", "hi", "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < out["new_tokens"] <= 4 and 2 not in out["token_ids"][:-1]


def test_missing_or_failing_template(tiny, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for f in tiny.iterdir():
        if f.name != "tokenizer_config.json":
            (d / f.name).symlink_to(f)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    assert "has no chat template" in run_cli(decode_main, "--weights", d, "--chat", "--prompt", "hi")
    (d / "chat_template.jinja").write_text("{{ raise_exception('only system messages') }}")
    assert "failed to render: TemplateError: only system messages" in run_cli(
        decode_main, "--weights", d, "--chat", "--prompt", "hi")
    (d / "chat_template.jinja").write_text("{% for %}")
    assert "failed to render" in run_cli(decode_main, "--weights", d, "--chat", "--prompt", "hi")
