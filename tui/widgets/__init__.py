"""The panels of the main screen, one module each."""
