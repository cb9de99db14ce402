//! `ModelLevers`: the switches that change how the model and its draft head run.
//!
//! Resolved once (from `SPECDRAFT_*` environment variables, or built by hand) and then
//! copied by value; nothing consults the environment on the hot path.

/// One `Copy` struct of switches, resolved once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelLevers {
    /// `SPECDRAFT_MTP_KV_EXACT`: after each verify, the engine calls `catchup_batch` so the
    /// draft head writes exact KV rows for every accepted draft (paired with the target's
    /// hidden) instead of keeping the rows it wrote while drafting.
    pub mtp_kv_exact: bool,
    /// `SPECDRAFT_MTP_TARGET_POSTNORM`: feed the draft head the target hidden after the
    /// target's final norm instead of before it.
    pub mtp_target_postnorm: bool,
    /// `SPECDRAFT_MTP_CHAIN_POSTNORM`: for drafts after the first, feed the head's own output
    /// hidden after its final norm instead of before it.
    pub mtp_chain_postnorm: bool,
    /// `SPECDRAFT_DEFER_DRAFTER_PREFILL`: always run the drafter prefill at the first
    /// propose, even for proposers that do not use the shared buffers.
    pub defer_drafter_prefill: bool,
}

/// The variables read by [`ModelLevers::from_env`], with the field each sets.
pub const LEVER_VARIABLES: [&str; 4] = [
    "SPECDRAFT_MTP_KV_EXACT",
    "SPECDRAFT_MTP_TARGET_POSTNORM",
    "SPECDRAFT_MTP_CHAIN_POSTNORM",
    "SPECDRAFT_DEFER_DRAFTER_PREFILL",
];

fn parse_flag(name: &str, value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        other => Err(format!(
            "{name}={other:?}: expected 1/0, true/false, yes/no or on/off"
        )),
    }
}

impl ModelLevers {
    /// Reads the levers from `SPECDRAFT_*` environment variables; unset means off.
    pub fn from_env() -> Result<Self, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the levers through `lookup` (a variable name to its value), so callers and
    /// tests can resolve them from any source.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let flag = |name: &str| lookup(name).map_or(Ok(false), |v| parse_flag(name, &v));
        Ok(ModelLevers {
            mtp_kv_exact: flag(LEVER_VARIABLES[0])?,
            mtp_target_postnorm: flag(LEVER_VARIABLES[1])?,
            mtp_chain_postnorm: flag(LEVER_VARIABLES[2])?,
            defer_drafter_prefill: flag(LEVER_VARIABLES[3])?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_sets_each_lever_and_rejects_garbage() {
        let levers =
            ModelLevers::from_lookup(|n| (n == "SPECDRAFT_MTP_KV_EXACT").then(|| "1".to_string()))
                .unwrap();
        assert!(levers.mtp_kv_exact);
        assert!(!levers.mtp_target_postnorm && !levers.mtp_chain_postnorm);
        let levers =
            ModelLevers::from_lookup(|n| (n != "SPECDRAFT_MTP_KV_EXACT").then(|| "on".to_string()))
                .unwrap();
        assert!(!levers.mtp_kv_exact && levers.mtp_target_postnorm && levers.mtp_chain_postnorm);
        let err = ModelLevers::from_lookup(|_| Some("maybe".into())).unwrap_err();
        assert!(err.contains("SPECDRAFT_MTP_KV_EXACT"), "{err}");
        assert_eq!(
            ModelLevers::from_lookup(|_| None).unwrap(),
            ModelLevers::default()
        );
    }
}
