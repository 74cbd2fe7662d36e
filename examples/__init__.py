"""Runnable examples; a package only so that tests can import them."""
