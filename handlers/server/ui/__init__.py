"""The page for people: the server's status and a playground (`GET /ui`, and `GET /` asked for
HTML), its files shipped in the package (page.py serves them), talking to the server's routes as
any client does."""
