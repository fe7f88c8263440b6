"""The engine in a process of its own, behind the server (`client.py`, `core.py`, `messages.py`)."""

# A step or a request's set-up may legitimately take seconds (a long prompt chunk, a grammar's
# compilation, a kernel compiled on first use); minutes without a due message is a hang.
ITERATION_TIMEOUT_S = 300.0
