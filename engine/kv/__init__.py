from engine.kv.block_manager import BlockManager, OutOfBlocks

__all__ = ["BlockManager", "OutOfBlocks"]
