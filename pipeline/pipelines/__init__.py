"""The classes a user constructs: one pipeline family a module."""
