"""The README's Python example runs as written."""
import re

from conftest import REPO


def test_readme_python_example_runs(capsys):
    text = open(f"{REPO}/README.md", encoding="utf-8").read()
    section = text[text.index("\n## Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "oasiskv.Cache(config" in code and "cache.release(ticket)" in code
    exec(compile(code, "README.md (Python)", "exec"), {})
    assert "Statistics(" in capsys.readouterr().out
