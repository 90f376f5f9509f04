"""The relay's database side: its statements (queries), the store that runs them over one
asyncpg pool (store), the settings of its sessions (session), and the reading of what holds
back VACUUM (snapshots)."""
