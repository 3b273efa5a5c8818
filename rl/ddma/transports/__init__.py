"""One module per DDMA transport, each defining ``TRANSPORT`` (see rl/ddma/transport.py)."""
