"""The Hopper kernel family: wgmma, mbarrier pipelines and warp specialisation (sm_90a)."""
