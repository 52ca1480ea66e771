"""`python -m resume_conformance.reference fsck DIR` (`fsck`) and `python -m resume_conformance.reference log DIR` (`log`)."""
