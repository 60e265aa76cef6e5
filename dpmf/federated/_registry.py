"""The storage of the privacy-mode registry: name → ``PrivacyMode`` class, filled by
``dpmf.federated.modes`` (``register_privacy_mode``) and read by the ledger, which accepts
entries of registered modes only. Imports nothing, so both can use it."""

PRIVACY_MODES: dict = {}
