"""The probe's version, in a module of its own: the session writes it into each run, and the
package re-exports it as ``probe.__version__`` (the session importing the package would cycle)."""

__version__ = "0.1.0"
