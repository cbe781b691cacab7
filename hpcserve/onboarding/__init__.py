"""Model onboarding: eval suites as data, their scorers, the parity gate, and
`hpcserve models eval` (docs/architecture.md, "Model onboarding")."""
