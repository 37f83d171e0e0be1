"""Questions the demo model answers, and the start of the answer eager float32 gives (greedy, 16
tokens): every default path is held to them (`longctx generate` in `tests/test_cli.py`, the served
chat in `tests/test_api_chat.py`). The bf16 head once tied "The" and "L" on the first."""

QUESTIONS = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the boiling point of water in Celsius?", "The boiling point of water in Celsius is"),
)
IDS = ("france", "japan", "boiling")
