"""States rebuilt offline from one recorded run, with no retraining: the directory a kill before each operation
leaves (`crash_states`), the one a power cut leaves (`powerloss`), and what the run's retention kept after each
commit, with a second fault on top (`retained`); states that differ only in files a resume never looked at
share its verdict (`unseen`)."""
