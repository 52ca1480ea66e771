"""States rebuilt offline from one recorded run, with no retraining: the directory a kill before each operation
leaves (`crash_states`) and the one a power cut leaves (`powerloss`)."""
