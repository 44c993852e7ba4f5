"""The engines tier: every test here is marked `engines` (skipped without the CPU builds of
`make engines`, failed instead when AREAL_REQUIRE_ENGINES=1, see tests/services.py)."""
