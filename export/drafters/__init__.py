"""Drafter exports: EAGLE-3 (eagle3.py), the checkpoint's own MTP head (mtp.py, its numpy reference
mtp_reference.py, a trimmed draft vocabulary vocab.py), and what both share (shared.py)."""
