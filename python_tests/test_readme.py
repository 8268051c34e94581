"""The README's Python API example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, str(README), "exec"), namespace)
        x = namespace["x"]
        assert x.feats.shape[0] == namespace["anchors"].shape[0]
        assert namespace["hidden"].grad is not None and namespace["mask_hidden"].grad is not None
