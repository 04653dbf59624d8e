"""Write README.md from nbs/index.ipynb (nbdev-readme needs Quarto, which is not installable offline).

Markdown cells are copied; code cells become ```python blocks without their `#|` directives; cells marked
`#| hide` are left out. `python tools/readme.py --check` exits 1 if README.md is not up to date."""
import json, sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent

def render(nb_path=root / "nbs" / "index.ipynb") -> str:
    parts = []
    for cell in json.loads(nb_path.read_text())["cells"]:
        src = "".join(cell["source"])
        lines = src.splitlines()
        directives = [l[2:].strip() for l in lines if l.startswith("#|")]
        if "hide" in directives: continue
        body = "\n".join(l for l in lines if not l.startswith("#|")).strip("\n")
        if not body: continue
        parts.append(body if cell["cell_type"] == "markdown" else f"```python\n{body}\n```")
    header = "<!-- WARNING: generated from nbs/index.ipynb by tools/readme.py; edit the notebook, not this file -->\n\n"
    return header + "\n\n".join(parts) + "\n"

if __name__ == "__main__":
    text, out = render(), root / "README.md"
    if "--check" in sys.argv:
        if not out.exists() or out.read_text() != text:
            sys.exit("README.md is out of date with nbs/index.ipynb: run `python tools/readme.py`")
    else:
        out.write_text(text)
