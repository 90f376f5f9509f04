"""The relay's database side: its statements (queries), the store that runs them (store) over
one asyncpg pool (pool), the settings of its sessions (session), the reading of what holds back
VACUUM (snapshots), and what an ordered destination's owner read of its rows (owned)."""
