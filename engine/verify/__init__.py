"""Checks that what is served computes what the reference does: the error measures and bounds
(`agreement.py`), and the compiled step's start-up self-check (`self_check.py`)."""
