//! Report types shared by the offline replay and the online run: latency summaries, load
//! spread over workers, and decision quality (the router's `kvroute_route_*` totals).

use kvroute::scheduler::DecisionStats;
use serde::Serialize;

pub use crate::stats::Summary;

/// Requests each worker received, relative to the mean.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LoadSpread {
    /// Fewest requests on one worker / mean.
    pub min_over_mean: f64,
    /// Most requests on one worker / mean.
    pub max_over_mean: f64,
    /// Requests per worker.
    pub requests: Vec<u64>,
}

impl LoadSpread {
    /// The spread of `requests` (one count per worker).
    pub fn of(requests: Vec<u64>) -> LoadSpread {
        let mean = requests.iter().sum::<u64>() as f64 / requests.len().max(1) as f64;
        LoadSpread {
            min_over_mean: requests.iter().copied().min().unwrap_or(0) as f64 / mean.max(1e-9),
            max_over_mean: requests.iter().copied().max().unwrap_or(0) as f64 / mean.max(1e-9),
            requests,
        }
    }
}

/// Decision quality over a run.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct DecisionReport {
    /// The totals.
    #[serde(flatten)]
    pub stats: DecisionStats,
    /// Blocks some worker had that the chosen one did not.
    pub lost_blocks: u64,
    /// lost / (novel + lost).
    pub regret: f64,
    /// Decisions that took the most cache reachable / decisions.
    pub optimal_ratio: f64,
}

impl From<DecisionStats> for DecisionReport {
    fn from(stats: DecisionStats) -> Self {
        DecisionReport {
            stats,
            lost_blocks: stats.lost_blocks(),
            regret: stats.regret(),
            optimal_ratio: stats.optimal as f64 / stats.decisions.max(1) as f64,
        }
    }
}
