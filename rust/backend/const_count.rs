//! [`with_count!`]: runs a body generic over a small constant count, picked at run time.
//!
//! Kernels that keep one register per row or per query take the count as a const generic,
//! so their arrays stay in registers; a call's count is only known at run time. This is the
//! one place that turns the one into the other.

/// Runs `$body` with `$N` a constant equal to `$n`, which must lie in 1..=8 (any other value
/// is a caller's bug: it panics, naming `$what`).
macro_rules! with_count {
    ($n:expr, $what:literal, |$N:ident| $body:expr) => {
        match $n {
            1 => {
                const $N: usize = 1;
                $body
            }
            2 => {
                const $N: usize = 2;
                $body
            }
            3 => {
                const $N: usize = 3;
                $body
            }
            4 => {
                const $N: usize = 4;
                $body
            }
            5 => {
                const $N: usize = 5;
                $body
            }
            6 => {
                const $N: usize = 6;
                $body
            }
            7 => {
                const $N: usize = 7;
                $body
            }
            8 => {
                const $N: usize = 8;
                $body
            }
            n => unreachable!("{} of {n}, not 1 to 8", $what),
        }
    };
}
pub(crate) use with_count;
