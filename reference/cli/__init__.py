"""`python -m reference fsck DIR` (`fsck`) and `python -m reference log DIR` (`log`)."""
