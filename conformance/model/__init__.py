"""The suite's vocabulary, which every layer above uses: crash points and schedules (`crash`), what a trainer
process is given and what it did (`process`), the contract a trainer is given in code (`context`), the
adapters that name a trainer (`adapters`) and how an adapter's module is imported and diagnosed
(`importing`), the fixed numbers and Hypothesis profiles (`settings`), the options' one table
(`flags`), the typed evidence behind every verdict (`evidence`), and the digests of a trainer's state
it may log beside its losses (`digest`)."""
