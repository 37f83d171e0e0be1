"""The engine core in a process of its own (`main`), the API process's client (`client`), the messages (`wire`)."""
