"""Training drafters for a target: a draft model, Medusa heads and EAGLE-style drafters, and the
checks the training scripts run before any model loads."""
