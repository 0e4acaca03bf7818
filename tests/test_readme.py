"""The README's quickstart runs as written (doctest of its Python block)."""
import doctest
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quickstart_runs_as_written():
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block.count(">>> ") >= 8
    test = doctest.DocTestParser().get_doctest(block, {}, "README quickstart", str(README), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted >= 8, result
