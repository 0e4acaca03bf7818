"""ddtree.integrations: ddtree inside other engines: SGLang's EAGLE tree-verify inputs (sglang).
Optional: nothing below imports this package, and it imports no engine at import time."""
