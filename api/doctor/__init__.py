"""`longctx doctor`: staged checks that a checkpoint is inferable here, not just loadable."""

from api.doctor.options import STAGES, DoctorOptions
from api.doctor.report import Report, StageResult
from api.doctor.run import run_doctor, run_stages

__all__ = ["STAGES", "DoctorOptions", "Report", "StageResult", "run_doctor", "run_stages"]
