"""The user API behind the ops subjects."""
