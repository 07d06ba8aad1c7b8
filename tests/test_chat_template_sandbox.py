"""Chat templates from model files render in a bounded sandbox: attribute walks, huge loops, recursion and
memory bombs are refused with one TokenizerError naming the file, within a time bound; the features real
templates use render exactly as in jinja2's own sandbox."""
import time
from datetime import datetime

import pytest

from edgellm import chat_template
from edgellm.chat_template import render_template
from edgellm.errors import TokenizerError

HOSTILE = {
    "class-walk": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "cycler-globals": ("{{ cycler.__init__.__globals__.os }}", "unsafe"),
    "mutate-input": ("{% for m in messages %}{{ m.update({'role': 'system'}) }}{% endfor %}", "unsafe"),
    "list-append": ("{% set l = [] %}{{ l.append(1) }}", "unsafe"),
    "range-huge": ("{% for i in range(10**9) %}x{% endfor %}", "number"),
    "range-budget": ("{% for i in range(1000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
                     "range|longer than"),
    "nested-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "range|longer than"),
    "loop-over-content": ("{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% endfor %}"
                          "{% endfor %}{% endfor %}", "longer than"),
    "repeat": ("{{ 'x' * 10**10 }}", "repeating"),
    "power": ("{{ 9 ** 999999 }}", "too large"),
    "center": ("{{ 'x'|center(10**10) }}", "number"),
    "ljust": ("{{ 'x'.ljust(10**10) }}", "number"),
    "printf-width": ("{{ '%999999999s' % 'x' }}", "width"),
    "format-width": ("{{ '{:999999999}'.format(1) }}", "width"),
    "format-filter": ("{{ '%999999999d'|format(1) }}", "width"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    "concat-doubling": ("{% macro d(s, n) %}{{ d(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ d('x', 60) }}",
                        "value"),
    "plus-doubling": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", "value"),
    "join-bomb": ("{% set s = 'x' * 8000000 %}{{ ([s] * 1000)|join|length }}", "value"),
    "replace-bomb": ("{% set s = 'x' * 10000 %}{{ s|replace('x', s)|length }}", "value"),
    "many-values": ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + ['x' * 1000000 ~ i] %}"
                    "{% endfor %}", "MiB|longer than"),
    "output-size": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output"),
    "syntax": ("{% for %}", "does not parse"),
    "lipsum": ("{{ lipsum(10**6) }}", "undefined"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_refused_in_time(name):
    template, needle = HOSTILE[name]
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError, match=needle) as e:
        render_template(template, "evil.gguf", messages=[{"role": "user", "content": "y" * 20000}])
    assert time.perf_counter() - t0 < chat_template.TIME_LIMIT_S + 3  # the bound, plus one step in C
    msg = str(e.value)
    assert msg.startswith("evil.gguf: chat template") and "\n" not in msg


def test_raise_exception_keeps_its_message_and_names_the_file():
    with pytest.raises(TokenizerError, match="evil.gguf: chat template: no system role"):
        render_template("{{ raise_exception('no system role') }}", "evil.gguf", messages=[])


# A tool-calling template in the style of Qwen2.5 / Llama 3.1: namespace, loop variables, tests, filters,
# slicing, string methods, tojson, strftime_now: what the real ones use.
REALISTIC = """{%- set ns = namespace(system='', n=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] | trim -%}{%- endif -%}
{%- if tools is defined and tools -%}
<|system|>{{ ns.system }}
Today is {{ strftime_now('%d %B %Y')[:2] | length }} chars. Tools:
{% for tool in tools %}{{ tool | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}
{%- else -%}<|system|>{{ ns.system or 'You are helpful.' }}{%- endif %}
{% for message in messages if message['role'] != 'system' -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception('roles must alternate') }}{%- endif -%}
{%- set ns.n = ns.n + 1 -%}
<|{{ message['role'] }}|>{{ message['content'].strip() | replace('\\r', '') }}
{%- if message.tool_calls is defined %}{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson(indent=2) }}}{% endfor %}{% endif %}
{%- if loop.last and message['role'] == 'user' %} [{{ '%d turns' % ns.n }}, {{ '{}/{}'.format(loop.index, loop.length) }}]{% endif %}
{% endfor -%}
{{ ['a', 'b'] | join(', ') ~ ' ' ~ ('x' * 3) ~ ' ' ~ (2 ** 10) ~ ' ' ~ ([1] + [2]) | string }}
{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list | length }}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_realistic_template_renders_as_in_jinja_sandbox():
    """The independent reference: jinja2's own ImmutableSandboxedEnvironment, without our bounds."""
    import json

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    messages = [{"role": "system", "content": "  Be brief.  "}]
    for i in range(100):
        messages.append({"role": "user", "content": f"question {i}\r ünïcödé 😀"})
        messages.append({"role": "assistant", "content": f"answer {i}",
                         "tool_calls": [{"function": {"name": "f", "arguments": {"x": i}}}]})
    messages.append({"role": "user", "content": "last"})
    tools = [{"name": "f", "parameters": {"x": "int"}}]
    context = dict(messages=messages, tools=tools, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    expected = env.from_string(REALISTIC).render(**context)
    got = render_template(REALISTIC, "model.gguf", **context)
    assert got == expected
    assert "<|assistant|>" in got and "[201 turns, 201/201]" in got and "a, b xxx 1024 [1, 2]" in got


def test_hostile_template_in_a_gguf_through_the_cli(tiny_llama, tmp_path):
    from tests.fuzz_cases import enc_kv, gguf_map, rebuilt
    from tests.test_errors_cli import assert_clean_error, run_cli

    data = tiny_llama[1].read_bytes()
    m = gguf_map(tiny_llama[1])
    i = next(i for i, kv in enumerate(m.kvs) if kv.key == "tokenizer.chat_template")
    f = tmp_path / "evil.gguf"
    f.write_bytes(rebuilt(data, m, kv_bytes={i: enc_kv("tokenizer.chat_template", 8, HOSTILE["class-walk"][0])}))
    assert_clean_error(run_cli("run", "Hi", "-m", str(f), "-n", "2"), str(f), "unsafe")
    ok = run_cli("run", "Hi", "-m", str(f), "-n", "2", "--raw")  # the model still runs without its template
    assert ok.returncode == 0, ok.stderr
