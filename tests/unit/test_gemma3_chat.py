"""`serve` on a Gemma 3 GGUF file uses the file's own chat template (tokenizer.chat_template),
rendered in jinja's sandbox: Gemma 3's template (as its tokenizer_config.json ships it) turns
a system message into the first user turn's prefix, calls the assistant "model", and refuses
roles that do not alternate, which serve answers as a bad request (a ValueError here)."""

from __future__ import annotations

import pytest

GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def test_gemma3_file_chat_template_is_used(tmp_path):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from shardwise.serve.text import ChatTemplate

    path = tmp_path / "gemma3.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "a", "b"]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([3, 3, 3, 2, 3, 3, 1, 1])
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_chat_template(GEMMA3_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    chat = ChatTemplate.load(path)
    assert chat.own, "the file's template was not picked up"
    text = chat.render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": " Hi there "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "And?"}]},
        ]
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nAnd?<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        chat.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
