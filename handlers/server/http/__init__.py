"""The HTTP wire: one router module per protocol, over the server context."""
